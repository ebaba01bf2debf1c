"""Command line: zcpo train | demo | eval | plan | report."""
