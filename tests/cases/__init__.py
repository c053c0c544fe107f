"""Platform-neutral test cases: run on every framework through tests.harness.frameworks.run_on."""
