"""The command line's one-line messages on standard error. Each begins `PREFIX` (an error, an
interruption); input the command refuses ends in one `ERROR` line and exit code
`EXIT_BAD_INPUT`. `launch` knows them in its processes' output."""

PREFIX = "boundary-jax: "
ERROR = PREFIX + "error: "
EXIT_BAD_INPUT = 2
