"""Helpers several test folders import (`from support.torchrun_job import run_torchrun`): tests/ is
on sys.path because it holds the root conftest.py."""
