from exod.cli import main

main()
