"""jupyter_server integration: extension, kernel and kernelspec managers, REST handlers."""
