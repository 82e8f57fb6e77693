"""The CLI's commands as the argparse parser declares them: what the man
page and the bash completion are made from."""

from __future__ import annotations

import argparse

from vstor.cli.main import build_parser


class Arg:
    """An option (flags) or a positional argument (no flags)."""

    def __init__(self, action: argparse.Action):
        self.flags = tuple(action.option_strings)
        self.takes_value = action.nargs != 0
        self.choices = tuple(action.choices) if action.choices else ()
        if action.metavar:
            self.metavar = action.metavar
        elif self.choices:
            self.metavar = "{" + ",".join(self.choices) + "}"
        else:
            self.metavar = action.dest.upper()
        self.optional = bool(self.flags) or action.nargs in ("?", "*")
        self.repeat = action.nargs in ("*", "+")
        self.required = bool(self.flags) and action.required
        help_ = action.help or ""
        if "%(" in help_:
            help_ = help_ % {"default": action.default, "prog": "vstor", "dest": action.dest}
        self.help = help_

    def synopsis(self) -> str:
        text = self.flags[-1] if self.flags else self.metavar
        if self.flags and self.takes_value:
            text += " " + self.metavar
        if self.repeat:
            text += " ..."
        return text if self.required or not self.optional else f"[{text}]"

    @property
    def kind(self) -> str:
        """What a value of it names, for completion: domain, vmid, file, dir,
        choice, or other (a word nothing lists)."""
        words = set(self.metavar.replace("|", " ").replace(".", " ").split())
        if self.choices:
            return "choice"
        if words & {"DOMAIN", "INSTANCE"}:
            return "domain" + ("+file" if "FILE" in words else "")
        if "VMID" in words:
            return "vmid"
        if words & {"FILE", "DISK"}:
            return "file"
        if "DIR" in words:
            return "dir"
        return "other"


class Command:
    def __init__(self, path: tuple[str, ...], help: str, parser: argparse.ArgumentParser):
        self.path, self.help = path, help
        self.description = parser.description or ""
        self.options: list[Arg] = []
        self.positionals: list[Arg] = []
        self.subcommands: list[Command] = []
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                helps = {a.dest: a.help or "" for a in action._choices_actions}
                for name, sub in action.choices.items():
                    self.subcommands.append(Command(path + (name,), helps.get(name, ""), sub))
            elif isinstance(action, argparse._HelpAction):
                continue        # -h on every command: said once, under OPTIONS
            elif isinstance(action, argparse._VersionAction) and path:
                continue
            elif action.option_strings:
                self.options.append(Arg(action))
            else:
                self.positionals.append(Arg(action))

    @property
    def name(self) -> str:
        return " ".join(("vstor",) + self.path)

    def walk(self):
        """This command and every command under it, depth first."""
        yield self
        for sub in self.subcommands:
            yield from sub.walk()

    def synopsis(self) -> str:
        parts = [self.name]
        parts += [a.synopsis() for a in self.options]
        if self.subcommands:
            parts.append("{" + ",".join(c.path[-1] for c in self.subcommands) + "} ...")
        parts += [a.synopsis() for a in self.positionals]
        return " ".join(parts)


def commands() -> Command:
    """The root command: `vstor`, from vstor.cli.main.build_parser()."""
    parser = build_parser()
    return Command((), parser.description or "", parser)
