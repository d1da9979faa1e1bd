"""`python -m rlx.engine.serve`: the engine server's command line (`rlx.engine.serve.cli`)."""

from rlx.engine.serve.cli import main

if __name__ == "__main__":
    main()
