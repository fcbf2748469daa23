"""The built-in backends: correct CPU stubs (``stubs``), one mutant per bug class (``mutants``), and
the DMA output workspace resource with its buggy variants (``resources``)."""
