"""Tests of the benchmark scripts: their smoke runs and their imports."""
