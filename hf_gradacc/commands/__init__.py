"""The `hf-gradacc` command line, wired by :mod:`.hf_gradacc_cli`: one package or module per subcommand, the
command's engine beside it (:mod:`.check`: the command in its ``__init__`` and what it measures and reports in its
modules; :mod:`.bench` likewise; :mod:`.plot`), and what they share in :mod:`._shared`."""
