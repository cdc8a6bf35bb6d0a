"""``python -m exod.runner``: one runner process (`exod.runner.process`)."""

from exod.runner.process import main

main()
