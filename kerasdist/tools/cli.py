"""The `kerasdist` console command: `kerasdist <subcommand> [args...]`.

Each subcommand is a "module:function" imported only when it runs, so
`kerasdist run` never pays for importing TensorFlow. A subcommand function
takes the remaining argv (a list) and returns an exit code. To add one, add
an entry to _COMMANDS.
"""

import importlib
import sys

# name -> ("module:function", one-line description for --help)
_COMMANDS = {
    "run": ("kerasdist.run.launch:main",
            "run a command on N ranks under mpiexec"),
    "timeline": ("kerasdist.tools.timeline:main",
                 "summarize or plot a timeline file"),
    "doctor": ("kerasdist.tools.doctor:doctor",
               "check this install and self-test every collective on 2 ranks"),
    "check-build": ("kerasdist.tools.doctor:check_build",
                    "print what the native library was built with"),
}


def _usage():
    width = max(len(name) for name in _COMMANDS)
    lines = ["usage: kerasdist <command> [args...]", "", "commands:"]
    for name, (_, summary) in sorted(_COMMANDS.items()):
        lines.append(f"  {name:<{width}}  {summary}")
    lines += ["", "Run `kerasdist <command> --help` for a command's options."]
    return "\n".join(lines) + "\n"


def _load(target):
    module_name, _, func_name = target.partition(":")
    return getattr(importlib.import_module(module_name), func_name)


def main(argv=None):
    """Dispatches `kerasdist <command> ...`; returns the exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        sys.stdout.write(_usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in _COMMANDS:
        sys.stderr.write(f"kerasdist: error: unknown command {name!r} "
                         f"(choose from {', '.join(sorted(_COMMANDS))})\n")
        return 2
    return _load(_COMMANDS[name][0])(rest)


if __name__ == "__main__":
    sys.exit(main())
