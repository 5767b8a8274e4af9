"""One module per `lmforge` command. Each has `main(argv) -> exit code`: it parses the arguments, calls the
library (train, eval, checkpoint, hf, prep, viz), and reports bad input through `lmforge.commands.errors`.
Nothing below this package imports it."""
