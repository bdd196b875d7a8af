"""The built-in tool-call parsers (components of kind `tool_parser`, registered in
`radixserve.builtin_components`) and the constrained-output parsers used for
`tool_choice="required"` or a named function."""
