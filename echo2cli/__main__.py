from echo2cli.cli import main

if __name__ == "__main__":  # vLLM's engine core uses spawn: the guard keeps children from re-running main
    main()
