"""speedpipe's launcher: command line, coordinator, serving and the stage backends.

[Note: torch's C++ warnings]
torch's distributed C++ code logs a warning with 20-odd lines of stack frames whenever a peer goes
away (TCPStore "recvValue failed ... Connection reset by peer" on a member node when node 0 exits,
gloo's "Connection closed by peer" when a stage dies). speedpipe says what happened in one line of its
own, so unless the user set `TORCH_CPP_LOG_LEVEL`, it is `ERROR` in the launcher and in the stage
workers it starts (they inherit the environment; the Ray backend forwards it). Set
`TORCH_CPP_LOG_LEVEL=WARNING` to see those warnings again. Python-side torch warnings are not affected.
It must be set before torch is first imported, hence here.
"""

import os

os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
