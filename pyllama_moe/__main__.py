from pyllama_moe.cli import main

raise SystemExit(main())
