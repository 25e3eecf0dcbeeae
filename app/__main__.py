from app.cli.main import main

raise SystemExit(main())
