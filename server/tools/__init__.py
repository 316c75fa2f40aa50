"""Tool calling: the shared parser types, one parser per `--tool-call-parser` format, the
registry, and the plan that turns `tools` / `tool_choice` into a grammar."""
