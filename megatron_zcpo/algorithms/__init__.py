"""Pure math: advantages, ZCPO calibration, surrogates, KL estimators and comparison methods (no process groups)."""
