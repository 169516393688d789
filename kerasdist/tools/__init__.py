"""The `kerasdist` command's tools: the console entry point (`cli`),
`kerasdist doctor` and `check-build` (`doctor`), `kerasdist timeline`
(`timeline`) and the generator of docs/env_vars.md's table
(`settings_doc`)."""
