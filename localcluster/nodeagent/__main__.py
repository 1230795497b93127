"""`python -m twinmq.localcluster.nodeagent`: run the process-backed node agent."""

import sys

from twinmq.localcluster.nodeagent.agent import main

sys.exit(main())
