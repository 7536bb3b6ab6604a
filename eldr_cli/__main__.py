from eldr_cli.main import main

main()
