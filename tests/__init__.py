"""The test suite: a package, so that test modules import as ``tests.test_*`` from the repository
root (ranks forked by ``tests.support.spawn`` import the functions they run by those names)."""
