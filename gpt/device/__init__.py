"""What this machine is and how to use it: the device and precision, host memory, peak FLOPS, CPU matmuls."""
