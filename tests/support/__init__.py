"""Test helpers: a real jupyter_server in a subprocess and a real websocket kernel client."""
