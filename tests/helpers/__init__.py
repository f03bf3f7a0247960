"""What several test files share that is not a fixture: paths, fakes, data writers."""
