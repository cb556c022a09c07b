"""`accelerate.commands.*` (through the shim): Accelerate's command modules as a Python API over accel's CLI.

Each module has Accelerate's name and public functions (`launch_command_parser`, `launch_command`, `env_command`,
`estimate_command`, `merge_command`, `write_basic_config`, ...). The parsers are accel's own (accel/cli/), taking
Accelerate's arguments with Accelerate's defaults in the namespace; the functions run accel's commands. Nothing here
launches, configures or estimates by itself.
"""
