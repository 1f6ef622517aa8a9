"""The offload decision: the calibration of this machine, the cost model, the policy and its explorer, and `ferry plan`."""
