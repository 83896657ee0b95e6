"""The argparse parser of the commands and scripts that take their flags with argparse (plot.py,
data/'s preparation, scripts/): a bad flag is one line, as configurator's are, not argparse's
usage block. Run their main under configurator.run_main, which prints it and exits 2."""

import argparse

from configurator import UserError


class Parser(argparse.ArgumentParser):
    def error(self, message):
        raise UserError(f"{message}; see --help")
