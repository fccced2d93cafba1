"""The root of the tests: pytest puts this folder on sys.path (prepend imports), so `support`, the
helpers several test folders share, imports from every test."""
