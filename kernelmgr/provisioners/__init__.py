"""jupyter_client kernel provisioners that hold a GPU slice for the life of a kernel."""
