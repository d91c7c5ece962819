"""`mhc fit|validate|test` from the command line: the LightningCLI, its checks, resume, interrupts, `mhc export`."""
