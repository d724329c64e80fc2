"""`tiercake bench ...`: every figure is printed as a ratio to a limit measured in the same run."""
