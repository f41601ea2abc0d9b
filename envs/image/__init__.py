"""A task's image, emulated on the host: what its Dockerfile and scripts would install.

    host_tools.py    what the host offers in place of an image's packages; apt/pip/uv/uvx stand-ins
    shell_syntax.py  the simple commands of a shell script, read with tree-sitter-bash
    installs.py      a script's install steps, resolved against the host
    dockerfile.py    a task's Dockerfile, emulated without Docker
"""
