# The testing kit's fixtures (model_server, runner, procs, local_sandbox, toolset_harness) for every
# test folder of this repository; a plugin's own tests/conftest.py holds only that plugin's fixtures.
pytest_plugins = ["hermes_batch.testing.fixtures"]
