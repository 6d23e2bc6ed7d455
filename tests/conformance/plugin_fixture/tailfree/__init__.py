raise ImportError("a plugin package's __init__ is not run by the overlay (it would import the plugin's runtime)")
