#!/bin/sh
# edgecloud's container entrypoint (tini runs it as PID 1's child): pull the model named by
# $EDGECLOUD_MODEL into the store ($EDGECLOUD_HOME, a volume) when it is absent, hand the node
# commands that model unless they name one, then exec the CLI so that SIGTERM reaches it and
# it drains. Invariant: the command it runs is `edgecloud "$@"` plus at most `--model NAME`.
set -eu

model="${EDGECLOUD_MODEL:-}"
case "${1:-} ${2:-}" in
    "edge serve" | "cloud serve")
        if [ -n "$model" ]; then
            if [ ! -d "$model" ]; then
                edgecloud models pull "$model" >/dev/null  # a check once it is there
            fi
            case " $* " in
                *" --model "*) ;;
                *) set -- "$@" --model "$model" ;;
            esac
        fi
        ;;
esac
exec edgecloud "$@"
