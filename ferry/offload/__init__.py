"""The offload decision: the calibration of this machine, the cost model, the policy and its explorer, the work
descriptions the run and `ferry plan` share, and `ferry plan`."""
