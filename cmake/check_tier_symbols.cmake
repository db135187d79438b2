# Fails when an object compiled for an ISA tier (a unit of tokamax_tier_sources, named
# *_<tier>.cc.o) defines a weak symbol outside tokamax::tier_<tier>: a weak copy of a shared inline
# function compiled with, say, AVX-512 flags could be the one the linker keeps for every caller.
# Usage: cmake -DNM=<nm> -DOBJECTS=<a;b;...> -P check_tier_symbols.cmake
set(tiers avx2 avx512bf16 avx512 amx)
set(failures "")
foreach(object ${OBJECTS})
  get_filename_component(name ${object} NAME)
  set(object_tier "")
  foreach(tier ${tiers})
    if(object_tier STREQUAL "" AND name MATCHES "_${tier}\\.cc\\.o$")
      set(object_tier ${tier})
    endif()
  endforeach()
  if(object_tier STREQUAL "")
    continue()
  endif()
  execute_process(COMMAND ${NM} -C --defined-only ${object} OUTPUT_VARIABLE symbols RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${NM} failed on ${object}")
  endif()
  string(REPLACE "\n" ";" lines "${symbols}")
  foreach(line ${lines})
    # Weak and unique symbols (W, V, u: inline functions, template instances, their statics)
    # are the ones the linker merges across units. Strong ones (T) are a tier's deliberate entry
    # points (DotGemmBf16, ...): one definition each, nothing to merge.
    if(line MATCHES "^[0-9a-f]+ [WVu] (.*)$")
      set(symbol "${CMAKE_MATCH_1}")
      # DW.ref.__gxx_personality_v0: the compiler's pointer to the C++ exception personality
      # routine, the same data in every unit.
      if(NOT symbol MATCHES "tokamax::tier_${object_tier}::" AND NOT symbol MATCHES "^DW\\.ref\\.__gxx_personality")
        string(APPEND failures "  ${name}: ${symbol}\n")
      endif()
    endif()
  endforeach()
endforeach()
if(failures)
  message(FATAL_ERROR "symbols of tiered units outside their tier's namespace:\n${failures}")
endif()
message(STATUS "tier symbols: all inside their tier namespaces")
