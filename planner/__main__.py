"""`python -m distplan.planner` runs the `distplan` command."""

from .cli import main

main()
