from nam_cli.main import main

main()
