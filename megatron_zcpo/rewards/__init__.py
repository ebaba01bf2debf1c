"""Rewards: math answer checking, overlong penalty, pluggable reward functions in a worker pool."""
