from pyllama_moe.cli.main import main

raise SystemExit(main())
