"""Running a decoder sharded over a mesh: jitted forward, prefill, decode and generation, and
token sampling."""
