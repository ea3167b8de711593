pytest_plugins = ("tests.fix_db", "tests.fix_queue", "tests.fix_workers")
