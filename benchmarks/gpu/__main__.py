from benchmarks.gpu.run import main

main()
