"""dlstore's tests; a package, so test modules import each other as ``tests.<module>``."""
