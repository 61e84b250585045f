// The one source of the object libraries that own the precompiled headers the programs reuse
// (CMakeLists.txt, "precompiled headers"): compiling it builds the header.
