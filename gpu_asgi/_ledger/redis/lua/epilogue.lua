-- After the body: record the busy state for the drain rate.
local result = main()
finish()
return result
