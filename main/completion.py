"""`archway completion bash|zsh`: a shell completion script made from the command line parser
itself, so every command, option and choice it completes is one archway accepts.

The script holds tables (command path -> its subcommands, options, options that take a value,
choices) and one small function that walks the words typed so far: no Python runs on TAB.
"""
import argparse
import sys

_SHELLS = ("bash", "zsh")


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "completion", help="print a shell completion script (bash or zsh)",
        description="Print the completion script of archway's commands, options and choices for "
                    "bash or zsh. bash: `source <(archway completion bash)` in ~/.bashrc, or save "
                    "it as /etc/bash_completion.d/archway. zsh: save it as _archway in a "
                    "directory of $fpath (before compinit runs), or `source <(archway completion "
                    "zsh)` after compinit.")
    parser.add_argument("shell", choices=_SHELLS)
    parser.set_defaults(func=run)


def run(args) -> int:
    from .cli import build_parser
    sys.stdout.write(script(build_parser(), args.shell))
    return 0


def tables(parser: argparse.ArgumentParser) -> dict[str, dict[str, str]]:
    """table name -> {key: space-separated words}; keys are command paths ("archway certs
    generate"), for choices "<path> <option>" (or "<path> " for a positional's choices)."""
    from .cli import subcommands
    out: dict[str, dict[str, str]] = {name: {} for name in
                                      ("commands", "options", "values", "paths", "choices")}
    for path, sub in [("", parser), *subcommands(parser)]:
        key = f"archway {path}".strip()
        names, options, values, paths = [], [], [], []
        for action in sub._actions:
            if isinstance(action, argparse._SubParsersAction):
                names += list(action.choices)
            elif action.option_strings:
                options += action.option_strings
                if action.nargs != 0:
                    values += action.option_strings
                    if action.choices:
                        for option in action.option_strings:
                            out["choices"][f"{key} {option}"] = " ".join(action.choices)
                    elif any(word in str(action.metavar) for word in ("FILE", "DIR")):
                        paths += action.option_strings
            elif action.choices:
                out["choices"][f"{key} "] = " ".join(action.choices)
        for table, words in (("commands", names), ("options", options), ("values", values),
                             ("paths", paths)):
            if words:
                out[table][key] = " ".join(words)
    return out


def script(parser: argparse.ArgumentParser, shell: str) -> str:
    data = tables(parser)
    if shell == "bash":
        lines = [f"declare -gA _archway_{name}=(" + " ".join(
            f"[{_quote(key)}]={_quote(words)}" for key, words in sorted(table.items())) + ")"
            for name, table in data.items()]
        return _BASH.replace("@TABLES@", "\n".join(lines))
    lines = [f"typeset -gA _archway_{name}\n_archway_{name}=(" + " ".join(
        f"{_quote(key)} {_quote(words)}" for key, words in sorted(table.items())) + ")"
        for name, table in data.items()]
    return _ZSH.replace("@TABLES@", "\n".join(lines))


def _quote(text: str) -> str:
    return "'" + text.replace("'", "'\\''") + "'"


# The same walk in both shells: words that name a subcommand of the path so far extend it, an
# option that takes a value skips that value; then complete the value of an option (its choices,
# or file names), an option, a subcommand, a positional's choices, or file names.
_BASH = r"""# bash completion for archway: `source <(archway completion bash)` (e.g. in ~/.bashrc), or
# save it as /etc/bash_completion.d/archway. Made by `archway completion bash`.
@TABLES@
_archway() {
    local cur=${COMP_WORDS[COMP_CWORD]} prev=${COMP_WORDS[COMP_CWORD-1]}
    local cmd=archway word i skip=0
    for ((i = 1; i < COMP_CWORD; i++)); do
        word=${COMP_WORDS[i]}
        if ((skip)); then skip=0; continue; fi
        case $word in
            -*=*) ;;
            -*) [[ " ${_archway_values[$cmd]} " == *" $word "* ]] && skip=1 ;;
            *) [[ " ${_archway_commands[$cmd]} " == *" $word "* ]] && cmd="$cmd $word" ;;
        esac
    done
    COMPREPLY=()
    if ((COMP_CWORD > 1)) && [[ " ${_archway_values[$cmd]} " == *" $prev "* ]]; then
        if [[ -n ${_archway_choices[$cmd $prev]} ]]; then
            COMPREPLY=($(compgen -W "${_archway_choices[$cmd $prev]}" -- "$cur"))
        elif [[ " ${_archway_paths[$cmd]} " == *" $prev "* ]]; then
            compopt -o filenames 2>/dev/null
            COMPREPLY=($(compgen -f -- "$cur"))
        fi
    elif [[ $cur == -* ]]; then
        COMPREPLY=($(compgen -W "${_archway_options[$cmd]}" -- "$cur"))
    elif [[ -n ${_archway_commands[$cmd]} ]]; then
        COMPREPLY=($(compgen -W "${_archway_commands[$cmd]}" -- "$cur"))
    elif [[ -n ${_archway_choices[$cmd ]} ]]; then
        COMPREPLY=($(compgen -W "${_archway_choices[$cmd ]}" -- "$cur"))
    else
        compopt -o filenames 2>/dev/null
        COMPREPLY=($(compgen -f -- "$cur"))
    fi
    return 0
}
complete -F _archway archway
"""

_ZSH = r"""#compdef archway
# zsh completion for archway: save it as _archway in a directory of $fpath (before compinit
# runs), or `source <(archway completion zsh)` after compinit. Made by `archway completion zsh`.
@TABLES@
_archway() {
    local cmd=archway word i skip=0
    for ((i = 2; i < CURRENT; i++)); do
        word=${words[i]}
        if ((skip)); then skip=0; continue; fi
        case $word in
            -*=*) ;;
            -*) [[ " ${_archway_values[$cmd]} " == *" $word "* ]] && skip=1 ;;
            *) [[ " ${_archway_commands[$cmd]} " == *" $word "* ]] && cmd="$cmd $word" ;;
        esac
    done
    local cur=${words[CURRENT]} prev=${words[CURRENT-1]}
    if ((CURRENT > 2)) && [[ " ${_archway_values[$cmd]} " == *" $prev "* ]]; then
        if [[ -n ${_archway_choices[$cmd $prev]} ]]; then
            compadd -- ${=_archway_choices[$cmd $prev]}
        elif [[ " ${_archway_paths[$cmd]} " == *" $prev "* ]]; then
            _files
        fi
    elif [[ $cur == -* ]]; then
        compadd -- ${=_archway_options[$cmd]}
    elif [[ -n ${_archway_commands[$cmd]} ]]; then
        compadd -- ${=_archway_commands[$cmd]}
    elif [[ -n ${_archway_choices[$cmd ]} ]]; then
        compadd -- ${=_archway_choices[$cmd ]}
    else
        _files
    fi
}
if [[ ${zsh_eval_context[-1]} == loadautofunc ]]; then
    _archway "$@"
else
    compdef _archway archway
fi
"""
