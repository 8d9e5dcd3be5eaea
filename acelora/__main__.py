from acelora.cli import main

raise SystemExit(main())
