"""Training on extracted features: the CTR model and its embedding lookup plans, the pipelined driver
(``pipeline``), the two-stage baseline, Ray Data and ``torchrun`` DDP."""
