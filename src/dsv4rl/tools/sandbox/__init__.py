"""The `python` tool's sandbox: `isolation` plans which layer gives each guarantee on this node, `probe`
measures what the node offers, `runner` is the child that sets the layers up and runs the code, `seccomp`
compiles its filter, `cgroups` bounds and empties each call. docs/agents.md says what each mode guarantees."""
