"""Runtime: applies a placement Plan to real modules (dispatch, input-moving hooks, offloading, casting)."""
