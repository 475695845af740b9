"""`pdplane plan`: P:D capacity planning on the simulator's engine model in modelled time."""
