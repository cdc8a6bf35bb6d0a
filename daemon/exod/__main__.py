from exod import main

main()
